"""Data: the offline English corpus, user datasets, packing, and the MQAR task."""
