"""Teacher scores: the teacher router, the cross-tokenizer alignment and the check that a teacher is above its student."""
