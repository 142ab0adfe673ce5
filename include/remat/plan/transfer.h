// The price of sending saved tensors away, as measured steps set it (NOTE
// [offload priced by the step]). A planner prices its offload options from
// isolated runs through a warm page cache; a real step sends every
// offloaded tensor at once, and a disk can take far longer for that. So
// each planned step that offloads is compared with its prediction: steps
// well over it charge the excess to the offload options, per byte they
// send; steps well under it give the charge back. The whole-step planner
// and CheckpointedSequential's planner share this rule; each applies the
// price to its own model.
#pragma once

#include <cstdint>

namespace remat::plan {

/** One call that sends what it saves to a disk store, as an isolated run
 *  measured it with one tensor in flight at a time (each save waits for
 *  the write before it). Times in ms. */
struct TransferRun {
  double forward_ms = 0;      ///< its forward, the waits for writes included
  double write_wait_ms = 0;   ///< of which it waited for writes (at most forward_ms)
  double write_ms = 0;        ///< the store's busy time writing its bytes (the disk's pace)
  int64_t written_bytes = 0;  ///< bytes it sent, before any encoding
  double backward_ms = 0;     ///< its backward, the waits for reads included
  double read_wait_ms = 0;    ///< of which it waited for reads (at most backward_ms)
  double read_ms = 0;         ///< the store's busy time reading them back
  int64_t read_bytes = 0;     ///< bytes it read back, before any encoding
  /** The largest tensor it sends: what the run held in flight (one tensor
   *  at a time), and what a store holds alone however small its cap. */
  int64_t largest_bytes = 0;
};

/** What the call waits for its store, ms, when the store may hold
 *  cap_bytes in flight. The run held one tensor in flight; the room beyond
 *  it is cap_bytes - largest_bytes. With room for all its bytes, its writes
 *  run beside its own compute and it waits only for what the disk takes
 *  beyond that (write_ms less the forward's compute, never below 0 nor
 *  above what it waited in the run); with room for a share of its bytes,
 *  that share runs beside, the rest is waited for as in the run; no room
 *  (a cap at or below its largest tensor): as in the run. Reads likewise
 *  over the backward.
 *  Leaves out other calls' transfers on the same disk (a step that
 *  offloads more than the disk keeps up with waits more: TransferPrice
 *  charges that from measured steps). Throws remat::Error for negative or
 *  non-finite figures, or waits above their phase's time. */
double transfer_wait_ms(const TransferRun& run, int64_t cap_bytes);

/** One planner's streaks of slow and fast steps, and the bytes its last
 *  charge was spread over. */
class TransferPrice {
 public:
  /** slow_steps_to_charge: planned steps in a row more than 10% over their
   *  prediction before the excess is charged (at least 1). */
  explicit TransferPrice(int slow_steps_to_charge = 1);

  /** A planned step that sent `sent` bytes to its stores (0: it offloaded
   *  nothing, which ends both streaks) took measured_ms against
   *  predicted_ms, with surcharge_ms_per_byte in force on the stores it
   *  used (the smallest, >= 0). Returns the ms per byte sent to add to the
   *  offload options' time, or 0 for no change:
   *  - after slow_steps_to_charge steps in a row more than 10% over, the
   *    last one's excess spread over its bytes (> 0);
   *  - after two steps in a row more than 10% under with a surcharge in
   *    force, the second one's shortfall spread over at least the bytes the
   *    last charge was spread over (a plan the charge moved to, which sends
   *    less, gives back in proportion: it does not undo the charge at once
   *    and bring the heavier plan back), and no more than the surcharge
   *    (< 0). One fast step (a page cache still warm) undoes nothing. */
  double observe(double measured_ms, double predicted_ms, double sent, double surcharge_ms_per_byte);

  /** Both streaks start again (a new plan, or a step over its budget); the
   *  last charge's bytes are kept. */
  void restart();
  /** As constructed: streaks and charge forgotten (new prices). */
  void reset();

 private:
  int needed_ = 1;
  int slow_ = 0, fast_ = 0;
  double charged_sent_ = 0;
};

}  // namespace remat::plan
