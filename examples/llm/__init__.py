"""A Llama-style decoder trained with forgeax ops (issue 36): `python -m examples.llm.train`."""
