"""Quick-start agents of the agent SDKs, each as its documentation writes it, with one tool and only the
endpoint and key set (``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``, passed where the SDK takes them).
Each runs as its own program, in its own environment (``make harnesses``), and prints its answer."""
