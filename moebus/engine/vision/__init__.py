"""Image encoders: pixels in, rows of the language model's input embeddings out."""
