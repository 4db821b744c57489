"""Container images, one flytekit ImageSpec per role (rollout, reward, train)."""

from images.specs import REGISTRY_ENV, reward_image, rollout_image, train_image

__all__ = ["REGISTRY_ENV", "reward_image", "rollout_image", "train_image"]
