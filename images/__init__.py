"""Container images, one flytekit ImageSpec per role (rollout, reward, train); ``--image`` overrides them."""

from images.specs import (
    REGISTRY_ENV,
    ROLES,
    RoleImage,
    given_image,
    reward_image,
    rollout_image,
    train_image,
)

__all__ = ["REGISTRY_ENV", "ROLES", "RoleImage", "given_image", "reward_image", "rollout_image", "train_image"]
