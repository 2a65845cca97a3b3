"""The Tinker training API (``inverted tinker-serve``): the user's own script drives the loop. See README.md."""
