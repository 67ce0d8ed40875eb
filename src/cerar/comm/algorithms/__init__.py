"""One rank's runs on the round engine: CERAR (compiled or torch ops), the exact ring, the packet scale."""
