"""Where a watch meets other tools: writers for TensorBoard, CSV and JSONL
(:mod:`.writers`), and a Hugging Face ``transformers`` Trainer callback (:mod:`.hf`, needs the
``hf`` extra). Each third-party package is imported only by the module that uses it."""
