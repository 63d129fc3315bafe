package route

import (
	"errors"
	"fmt"
	"regexp"
	"strings"
	"unicode/utf8"
)

// Job is the shape of the River job a rule inserts into one queue. The zero
// value of every field but Queue means the default: kind DefaultKind with
// envelope args, River's default priority (1) and the inserting client's
// MaxAttempts (River's default, 25), no tags.
type Job struct {
	// Queue is the River queue of the job.
	Queue string
	// Kind is the River job kind, the kind a river.Worker[T] is registered
	// for. "" means DefaultKind ("outbox_event").
	Kind string
	// Args is the shape of the job's args: ArgsEnvelope (the default) or
	// ArgsPayload.
	Args Args
	// Priority is River's priority, 1 (highest) to 4 (lowest). 0 means
	// River's default, 1.
	Priority int
	// MaxAttempts is the most attempts River makes, 1 to 32767. 0
	// means the inserting client's default (River's is 25).
	MaxAttempts int
	// Tags are River job tags: each 3 to 255 characters of [A-Za-z0-9_]
	// with inner '-'.
	Tags []string
	// Line is the line of the job in the routes file (its jobs: entry, or
	// its rule), 0 when built in code.
	Line int
}

// Args is the shape of a job's args.
type Args string

const (
	// ArgsEnvelope means the args are outboxriver.EventArgs (event id, type,
	// tenant, payload, dispatch key, created_at), what outboxriver.Worker
	// decodes. The default.
	ArgsEnvelope Args = "envelope"
	// ArgsPayload means the args are the event's payload, verbatim, so an
	// existing river.Worker[T] decodes it as its own T.
	ArgsPayload Args = "payload"
)

// DefaultKind is the job kind of a rule that names none: the outbox
// envelope's kind, worked by outboxriver.Worker.
const DefaultKind = "outbox_event"

// River's limits on job shape (github.com/riverqueue/river v0.51).
const (
	// maxKindLength is the longest kind, in characters: river_job has
	// CHECK (char_length(kind) < 128).
	maxKindLength = 127
	// maxTagLength is the longest tag (River refuses longer ones at insert).
	maxTagLength = 255
	// maxMaxAttempts is the largest max_attempts: river_job.max_attempts is
	// a smallint.
	maxMaxAttempts = 32767
	// minPriority and maxPriority bound River's priority (1 is the highest).
	minPriority, maxPriority = 1, 4
)

var (
	// kindPattern is River's rule for job kinds (rivercommon.
	// UserSpecifiedIDOrKindRE): a River client refuses to register a
	// worker whose kind does not match it.
	kindPattern = regexp.MustCompile(`\A[\w][\w\-\[\]<>\/.·:+]+\z`)
	// tagPattern is River's rule for tags (river.tagRE): an insert with a
	// tag that does not match it fails.
	tagPattern      = regexp.MustCompile(`\A[\w][\w\-]+[\w]\z`)
	kindReplaceChar = regexp.MustCompile(`[^\w\-\[\]<>\/.·:+]+`)
	tagReplaceChars = regexp.MustCompile(`[^\w\-]+`)
)

// validateKind returns an error, with a suggested fix, when River would
// refuse kind as a job kind.
func validateKind(kind string) error {
	switch n := utf8.RuneCountInString(kind); {
	case kind == "":
		return errors.New("kind is empty: leave it out for the default " + DefaultKind + ", or give your worker's kind")
	case n > maxKindLength:
		return fmt.Errorf("kind %q is %d characters, River allows at most %d", kind, n, maxKindLength)
	case !kindPattern.MatchString(kind):
		msg := fmt.Sprintf("kind %q is not valid for River: use at least two characters, a letter, digit or '_' first, then letters, digits and _ - [ ] < > / . · : + (no spaces or commas)", kind)
		if s := strings.Trim(kindReplaceChar.ReplaceAllString(kind, "_"), "_"); s != "" && s != kind && kindPattern.MatchString(s) && utf8.RuneCountInString(s) <= maxKindLength {
			msg += fmt.Sprintf("; try %q", s)
		}
		return errors.New(msg)
	}
	return nil
}

// validateTag returns an error, with a suggested fix, when River would
// refuse tag.
func validateTag(tag string) error {
	switch {
	case len(tag) > maxTagLength:
		return fmt.Errorf("tag %q is %d characters, River allows at most %d", tag, len(tag), maxTagLength)
	case !tagPattern.MatchString(tag):
		msg := fmt.Sprintf("tag %q is not valid for River: use 3 to %d of the characters A-Z a-z 0-9 _ with '-' only inside (no dots, spaces or commas)", tag, maxTagLength)
		if s := strings.Trim(tagReplaceChars.ReplaceAllString(tag, "_"), "_-"); s != tag && tagPattern.MatchString(s) {
			msg += fmt.Sprintf("; try %q", s)
		}
		return errors.New(msg)
	}
	return nil
}

// validateArgs checks an args shape ("" is the default, envelope).
func validateArgs(a Args) error {
	switch a {
	case "", ArgsEnvelope, ArgsPayload:
		return nil
	default:
		return fmt.Errorf("args %q is not a shape: use envelope (outboxriver.EventArgs, the default) or payload (the event payload as the job's args)", string(a))
	}
}

// validatePriority checks a priority given explicitly (0 is not).
func validatePriority(p int) error {
	if p < minPriority || p > maxPriority {
		return fmt.Errorf("priority %d is out of range: River's priorities are 1 (highest) to 4 (lowest); leave it out for 1", p)
	}
	return nil
}

// validateMaxAttempts checks a max_attempts given explicitly (0 is not).
func validateMaxAttempts(n int) error {
	if n < 1 || n > maxMaxAttempts {
		return fmt.Errorf("max_attempts %d is out of range: give 1 to %d; leave it out for the client's default (River's is 25)", n, maxMaxAttempts)
	}
	return nil
}

// ValidateInsert returns an error, naming the field and the rule, when
// River would refuse to insert a job with this queue, priority, max
// attempts and tags. The values are those the insert writes: 0 is not a
// default here. The handoff checks every job it writes with it (package
// claim), by the same rules as the routes file.
func ValidateInsert(queue string, priority, maxAttempts int, tags []string) error {
	if err := ValidateQueueName(queue); err != nil {
		return err
	}
	if err := validatePriority(priority); err != nil {
		return err
	}
	if err := validateMaxAttempts(maxAttempts); err != nil {
		return err
	}
	for _, t := range tags {
		if err := validateTag(t); err != nil {
			return err
		}
	}
	return nil
}

// normalize fills the defaults of j and checks every field but Queue (New
// checks queues). The errors name the field and the fix.
func (j *Job) normalize() []error {
	var errs []error
	if j.Kind == "" {
		j.Kind = DefaultKind
	} else if err := validateKind(j.Kind); err != nil {
		errs = append(errs, err)
	}
	if j.Args == "" {
		j.Args = ArgsEnvelope
	}
	if err := validateArgs(j.Args); err != nil {
		errs = append(errs, err)
	}
	if j.Args == ArgsPayload && j.Kind == DefaultKind {
		errs = append(errs, fmt.Errorf("args: payload needs the kind of the worker that decodes the payload (kind: send_invoice_email, say): kind %s is the envelope's, whose worker (outboxriver.Worker) decodes outboxriver.EventArgs; for that worker, leave args out", DefaultKind))
	}
	if j.Priority != 0 {
		if err := validatePriority(j.Priority); err != nil {
			errs = append(errs, err)
		}
	}
	if j.MaxAttempts != 0 {
		if err := validateMaxAttempts(j.MaxAttempts); err != nil {
			errs = append(errs, err)
		}
	}
	for _, t := range j.Tags {
		if err := validateTag(t); err != nil {
			errs = append(errs, err)
		}
	}
	if j.Tags != nil {
		j.Tags = append([]string(nil), j.Tags...)
	}
	return errs
}
