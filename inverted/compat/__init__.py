"""Other frameworks' plug-in APIs on inverted, so their users bring their code over unchanged (``slime``)."""
