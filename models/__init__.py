"""libai_zoo.models: GPT-2, BERT, ViT and Llama built from `libai_zoo.layers`, with Hugging Face
weights in and out."""
