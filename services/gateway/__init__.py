"""Gateway: the public GenerateService (validation, tokenization, detokenization)."""
