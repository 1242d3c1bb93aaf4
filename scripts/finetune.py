"""Fine-tune a converted model: the same as `hf-softmax-rnn finetune` (see its --help).

python scripts/finetune.py --output-dir out/l2 --attention gated_softmax_no_gate_L2norm_nodivS_noclamp
ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 scripts/finetune.py --output-dir out/l2
"""

import sys

from hf_softmax_rnn.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["finetune", *sys.argv[1:]]))
