"""Spatial control: the conditioning images a ControlNet phase trains with (Canny edges first), how they are stored
next to the latents, and how controllability is scored (docs/CONTROL.md)."""
