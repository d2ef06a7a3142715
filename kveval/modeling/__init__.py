"""What kveval knows about model architectures and layer types, and where models and tokenizers come from."""
