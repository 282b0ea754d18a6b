"""From logits to tokens: the one ordered logits pipeline, grammar masks, seeded sampling, speculative drafts and their verification."""
