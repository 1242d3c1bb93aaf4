"""Data: the offline English corpus, user datasets, packing, long evaluation texts, and the MQAR task."""
