"""Where a watch meets other tools: the :class:`~.writers.WatchWriter` protocol, its writers for
TensorBoard, CSV and JSONL and the atomic file writing they share (:mod:`.writers`); a W&B
writer (:mod:`.wandb`, needs the ``wandb`` extra); the watch as a Hugging Face ``transformers``
Trainer callback (:mod:`.hf`, the ``hf`` extra) and as a Lightning callback (:mod:`.lightning`,
the ``lightning`` extra), which share the driving of one optimizer step (:mod:`._steps`). Each
third-party package is imported only by the module that uses it."""
