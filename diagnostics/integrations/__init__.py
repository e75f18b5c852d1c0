"""Where a watch meets other tools: the :class:`~.writers.WatchWriter` protocol, its writers for
TensorBoard, CSV and JSONL and the atomic file writing they share (:mod:`.writers`), and a
Hugging Face ``transformers`` Trainer callback (:mod:`.hf`, needs the ``hf`` extra). Each
third-party package is imported only by the module that uses it."""
