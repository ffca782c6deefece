"""Per-model maps between libai_zoo parameters and Hugging Face tensor names, built from the
rules of `libai_zoo.hf.rules`."""
