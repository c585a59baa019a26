"""quant_core."""
