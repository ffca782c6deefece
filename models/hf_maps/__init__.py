"""Per-model maps between libai_zoo parameters and Hugging Face tensor names (see `rules`)."""
