"""Requests on their way in and out: the request's state, every input check, images and grammars, and output processing (detokenizing, stops)."""
