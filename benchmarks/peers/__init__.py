"""Set-up helpers for the side-by-side benchmark: one module per peer, plus what they share."""
