"""`lowmem_aitextgen serve`: OpenAI's API over the batch engine."""
