"""Speculative decoding: proposers of draft tokens (issue 20, in progress).

``ngram.py``: n-gram prompt lookup, vectorised over the batch. Not yet
wired into the engine: the runner does not verify drafts yet.
"""
