"""Where draws come from: logits sources, samplers (the mismatch options), seeds, alias tables and
multinomial count vectors."""
