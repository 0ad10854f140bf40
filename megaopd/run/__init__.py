"""A run end to end: settings resolved and planned, the trainer loop, evaluation, stopping, and studies of many runs."""
