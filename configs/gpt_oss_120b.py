"""gpt-oss-120b (116.8B parameters, 5.1B active per token: 128 experts, top-4). gpt-oss-20b's architecture
(configs/gpt_oss_20b.py) with 36 layers and 128 experts per feed-forward, from the released checkpoint's config.json.
``jaxtrain.models.gpt_oss.param_counts`` on the abstract shapes: 116,829,156,672 total (transformers' count of the
same shapes), 5,132,849,472 active (the published 116.8B / 5.1B; the model card's 5.13B). Pod-scale defaults as
gpt-oss-20b's (256 chips: expert 8 x fsdp 32, 25.3 GiB per chip by the estimate).

  python tools/estimate.py --config=configs/gpt_oss_120b.py --devices=256 --set=mesh.expert=8 --set=mesh.fsdp=32
"""

from configs import gpt_oss_20b


def get_config():
  return gpt_oss_20b.get_config(num_layers=36, num_experts=128, name="gpt_oss_120b")
