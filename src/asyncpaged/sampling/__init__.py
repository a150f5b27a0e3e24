"""From logits to tokens: sampling options, logits processing, draws and speculative
verification."""
