"""The values every layer shares: errors, the config and its validation, sampling, trees and their
shapes, the verifiers (pure tensor functions), request processors, draft-length policies, metrics,
fidelity statistics and prompt formats. Imports nothing of specdraft above it."""
