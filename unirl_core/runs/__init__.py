"""Operations on stored runs: replay a step bit for bit, re-score a run's batches with other rewards, export a
version as a folder other libraries load. Above the loop and compose: it reruns their steps, they never import it."""
