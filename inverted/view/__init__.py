"""``inverted view``: a job's output directory in the browser (``index``: what is read; ``service``: the app)."""
