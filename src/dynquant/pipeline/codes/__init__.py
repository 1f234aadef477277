"""How codes are chosen (round-to-nearest or error-compensating GPTQ) and written to a
checkpoint."""
