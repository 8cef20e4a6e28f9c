"""The worker process: pull loop (``worker``) and model runner (``runner``)."""
