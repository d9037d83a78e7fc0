"""Benchmarks that print a table and write JSON: prefill/decode latency (MoE vs matched
ConceptMoE), the dechunk scan, our MoE vs transformers. Imports model/, inference/ and
errors; run directories come in through a loader the caller passes.
"""
