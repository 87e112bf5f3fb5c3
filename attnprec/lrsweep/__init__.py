"""Does attention precision matter in training? An LR sweep (`make sweep`).

Small byte-level models trained over a grid of learning rates under several precision
settings (bf16 with the flags off, both flags, float32, qk-norm), side by side per
(size, setting) in one vmapped program; LR sensitivity with paired bootstrap intervals,
logit growth, a report. Modules: `corpus` (the frozen text), `settings` (sizes and
settings as data, the plan's checks), `group` (one size x setting: training and
evaluation), `job` (the gin job, resumable), `report` (sensitivity, intervals, plots).
"""
