"""The recipes: `steadytrain finetune` (LoRA / QLoRA of a Hugging Face causal LM) and the
commands around it, each run through the engine's `Trainer` (there is no second loop here).

finetune.py           `steadytrain finetune --config FILE`: the fine-tune through the `Trainer`
finetune_config.py    its config: Hugging Face `TrainingArguments` names, mapped onto `TrainConfig`
finetune_memory.py    a fine-tune's memory, estimated with its own settings before anything loads
finetune_resume.py    rerunning on an interrupted output_dir: which changes keep it the same run
options.py            the options of each recipe's command, one frozen dataclass per command
model.py              a causal LM and its tokenizer loaded and wrapped in peft
data.py               fine-tuning data: records to token ids with a loss mask, then batches
records.py            a JSON or JSONL file of records read and checked, its format detected
tokens.py             records to token ids with a loss mask (text, prompt + completion, chat)
byte_tokenizer.py     a tokenizer that needs no download, for the demo and the tests
training_log.py       RUN_DIR/training.log: what the console showed, kept
artifact.py           what a fine-tune leaves behind, found and loaded the same way by merge,
                      generate and evaluate
checkpoint_export.py  a mid-run checkpoint as a peft adapter folder (`steadytrain export`)
merge.py              `steadytrain merge`: a LoRA adapter folded into its base
generate.py           `steadytrain generate`: text from a fine-tuned model
evaluate.py           `steadytrain evaluate`: loss and perplexity, base and adapter side by side
demo.py               `steadytrain demo`: the whole product in about a minute, offline

The supervisor is used through its public names only (pyproject.toml's contracts).
"""
