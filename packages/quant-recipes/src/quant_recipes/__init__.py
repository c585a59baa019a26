"""quant_recipes."""
