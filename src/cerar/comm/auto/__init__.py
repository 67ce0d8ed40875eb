"""``method="auto"``: the fastest method within an error budget, measured and agreed on every rank."""
