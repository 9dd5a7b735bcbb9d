"""Integrations with other libraries, each imported on its own (``import flashgen`` imports none of them):
``flashgen.integrations.transformers`` registers the ``"flashgen"`` attention backend of Hugging Face
transformers (the ``hf`` extra)."""
