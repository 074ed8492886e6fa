"""Speculative decoding: draft proposers and draft verification.

``ngram.py``: n-gram prompt lookup, vectorised over the batch.
``proposer.py``: what a proposer is to the model runner.
``rejection.py``: verifying a step's drafts against the target's logits.
"""
