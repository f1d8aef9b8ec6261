"""generate() in its parts: the arguments, the decoding plan and forms, the views, the batch engine, sampling."""
