"""From logits to tokens: the sampler and its rows, structured output's grammars and masks, and
speculative decoding's proposals (n-gram or a draft model)."""
