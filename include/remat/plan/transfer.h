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

namespace remat::plan {

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
