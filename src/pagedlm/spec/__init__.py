"""Speculative decoding's draft side: proposers behind one interface (proposer.py), n-gram prompt lookup
(ngram.py), OpenAI's Predicted Outputs (prediction.py), and each sequence's adaptive draft length (state.py). The
engine verifies the drafts (engine/spec_decode.py): this package knows token ids, not requests or the KV cache."""
