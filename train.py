"""Train or evaluate from a Hydra config.

python train.py experiment=demo
python train.py experiment=ssd300_fp16_8gpu data.root=/coco
python train.py experiment=ssd300_eval ckpt_path=outputs/.../last.ckpt
"""

import hydra
from omegaconf import DictConfig

from ssd_lightning.cli.host_memory import reuse_host_memory
from ssd_lightning.cli.resolvers import register_resolvers

register_resolvers()


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> float | None:
    if cfg.get("reuse_host_memory"):
        reuse_host_memory()  # before torch runs: it reads THP_MEM_ALLOC_ENABLE at its first allocation
    from ssd_lightning.cli.train import main as run  # torch and Lightning: not needed for --cfg/--help

    return run(cfg)


if __name__ == "__main__":
    main()
