"""What a run costs and what it logs: the FLOP formulas and model shapes, the FLOP ledger, and the metrics a step writes."""
