"""The embedded demo: the synthetic captioned corpus, its loopback image server and its tiny locally built models."""
