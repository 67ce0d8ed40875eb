"""``cerar study``: the accuracy study on synthetic inputs and on captured training gradients."""
