"""Layer 7, `integrations`: nebula inside training frameworks.

Holds: what Lightning's two packages share (lightning_common; `nebulaml.lightning` and
`nebulaml.pytorch_lightning` are the public modules built on it); the Hugging Face Trainer
(transformers, public as `nebulaml.transformers`) and Accelerate (accelerate, public as
`nebulaml.accelerate`), with what the two share (hf_common); PyTorch's Distributed
Checkpoint (dcp, public as `nebulaml.dcp`); DeepSpeed's Nebula engine (deepspeed:
`torch_nebula.Checkpoint`, and `materialize` for DeepSpeed's tools that read its
save_dir).

May import: everything, the public API (`nebulaml.api`, `nebulaml.checkpoint`) included.
Not for: anything the core needs: no layer below imports from here.
"""
