"""Speculative decoding (MTP / n-gram drafts).  Placeholder until the MTP work lands: no drafting."""


def draft_plan(engine):
    return None
