"""``sdforge preflight``: the full configuration run end to end on small local samples of every source."""
