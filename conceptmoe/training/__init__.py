"""Training and what a run directory is made and read by: data, tokenizer, the train loop,
checkpoints, evaluation, compare, boundaries. Imports model/ and errors only; never
inference/, bench/ or cli/.
"""
