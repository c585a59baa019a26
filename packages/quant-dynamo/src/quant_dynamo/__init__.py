"""quant_dynamo."""
